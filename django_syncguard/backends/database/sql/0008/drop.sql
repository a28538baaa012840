-- The first half of migration 0008's reverse: drops what it added (the twelve-argument
-- acquire, the three-argument release, the claim and the hand-over). The migration then
-- runs 0007's acquire.sql, 0005's release.sql and withdraw.sql and 0002's extend.sql
-- again, which put back the bodies this version replaced; the grant columns go after.
DROP FUNCTION IF EXISTS syncguard_acquire(
    text, text, text, bigint, text, bigint, bigint, text, bigint, boolean, text, bigint);
DROP FUNCTION IF EXISTS syncguard_release(text, bigint, boolean);
DROP FUNCTION IF EXISTS syncguard_claim(text, bigint);
DROP FUNCTION IF EXISTS syncguard_hand_over(text, bigint, bigint, boolean, boolean);
