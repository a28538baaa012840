# PostgreSQL only: the acquire, release and withdraw of fair, notified waiting (see
# django_syncguard/waiting.py and specs/backends/database.md, Queues and wake-ups).
# Still one statement per operation. The reverse restores migration 0002's functions.

from django.db import migrations

from django_syncguard.backends.database import sql

# The functions, from django_syncguard/backends/database/sql/0005/ (see the docstring
# of that package: released files never change). Order matters: the seven-argument
# acquire calls the nine-argument one, release and withdraw call syncguard_channel.
FORWARD = sql.load(
    "0005", "sequence", "channel", "acquire", "acquire_legacy", "release", "withdraw"
)
REVERSE = sql.load("0005", "drop") + sql.load("0002", "acquire", "release")


class Migration(migrations.Migration):
    dependencies = [("django_syncguard", "0004_waiters")]

    operations = [
        sql.run_on_postgresql(FORWARD, REVERSE),
    ]
