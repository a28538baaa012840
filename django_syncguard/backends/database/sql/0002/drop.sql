-- The reverse of migration 0002: drops the three functions it installed.
DROP FUNCTION IF EXISTS syncguard_acquire(text, text, text, bigint, text, bigint, bigint);
DROP FUNCTION IF EXISTS syncguard_release(text, bigint);
DROP FUNCTION IF EXISTS syncguard_extend(text, bigint, bigint);
