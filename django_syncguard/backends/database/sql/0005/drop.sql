-- The first half of migration 0005's reverse: drops what it added. The migration then
-- runs 0002's acquire.sql and release.sql again to restore the functions it replaced.
DROP FUNCTION IF EXISTS syncguard_withdraw(text, text, bigint);
DROP FUNCTION IF EXISTS syncguard_acquire(text, text, text, bigint, text, bigint, bigint);
DROP FUNCTION IF EXISTS
    syncguard_acquire(text, text, text, bigint, text, bigint, bigint, text, bigint);
DROP FUNCTION IF EXISTS syncguard_channel(text);
DROP SEQUENCE IF EXISTS syncguard_waiters_arrival;
