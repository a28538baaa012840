-- The first half of migration 0009's reverse: drops what it added (the fourteen-argument
-- acquire, the four-argument release and withdraw, the six-argument hand-over and the
-- grant check). The migration then runs 0008's hand_over.sql, acquire.sql,
-- release.sql and withdraw.sql again, which put back the five-argument hand-over and
-- the bodies this version turned into wrappers; the process_channel column goes after.
DROP FUNCTION IF EXISTS syncguard_acquire(
    text, text, text, bigint, text, bigint, bigint, text, bigint, boolean, text, bigint,
    text, boolean);
DROP FUNCTION IF EXISTS syncguard_release(text, bigint, boolean, boolean);
DROP FUNCTION IF EXISTS syncguard_withdraw(text, text, bigint, boolean);
DROP FUNCTION IF EXISTS syncguard_check_grant(text, text, bigint, boolean);
DROP FUNCTION IF EXISTS syncguard_hand_over(text, bigint, bigint, boolean, boolean, boolean);
