-- The first half of migration 0006's reverse: drops the ten-argument acquire it added.
-- The migration then runs 0005's acquire.sql again, which puts back the nine-argument
-- function's own body in place of the wrapper (0005's seven-argument wrapper was never
-- replaced). The floor row, if any, stays in syncguard_fence_counters: code before
-- 0006 never reads it, and migrating forward again finds it in force.
DROP FUNCTION IF EXISTS
    syncguard_acquire(text, text, text, bigint, text, bigint, bigint, text, bigint, boolean);
