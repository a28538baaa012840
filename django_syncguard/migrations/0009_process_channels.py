# Per-process grant channels (specs/decisions.md, 48; specs/backends/database.md,
# Grants): on PostgreSQL a grant is NOTIFYed on the channel of the grantee's process
# alone, not on the key's (which every waiting process LISTENs on), and a releasing
# process that can check its grant once the window is over asks the hand-over to tell
# nobody else. The waiter's grant record gains that channel (nullable, no default: no
# table rewrite; NULL for waiters of code deployed before this version, whose grants
# stay on the key's channel). The functions (sql/0009/): acquire, release and withdraw
# with a "watched" parameter that reports the ticket they granted, the hand-over that
# picks the channel, and the grant check. The functions of code deployed before this
# version keep their signatures as wrappers that never watch. The reverse restores the
# functions 0009 replaced; the column goes after them.

from django.db import migrations, models

from django_syncguard.backends.database import sql

# The functions, from django_syncguard/backends/database/sql/0009/ (released files
# never change). Each wrapper comes after the function it calls: a LANGUAGE sql body
# is checked against it when it is created.
FORWARD = sql.load(
    "0009",
    "hand_over",
    "acquire",
    "acquire_legacy",
    "release",
    "release_legacy",
    "withdraw",
    "withdraw_legacy",
    "check_grant",
)
REVERSE = sql.load("0009", "drop") + sql.load(
    "0008", "hand_over", "acquire", "release", "withdraw"
)


class Migration(migrations.Migration):
    dependencies = [("django_syncguard", "0008_grants")]

    operations = [
        migrations.AddField(
            model_name="waiter",
            name="process_channel",
            field=models.TextField(null=True),
        ),
        sql.run_on_postgresql(FORWARD, REVERSE),
    ]
