-- The first half of migration 0007's reverse: drops the eleven-argument acquire it
-- added. The migration then runs 0006's acquire.sql again, which puts back the
-- ten-argument function's own body in place of the wrapper; the owner and
-- queued_at_ms columns go after it.
DROP FUNCTION IF EXISTS
    syncguard_acquire(text, text, text, bigint, text, bigint, bigint, text, bigint, boolean, text);
