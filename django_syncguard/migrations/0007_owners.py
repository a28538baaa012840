# Who holds a lock (django_syncguard/owners.py; specs/backends/database.md, Owners):
# each lock row's owner label (NULL when the alias does not record owners, and for rows
# written before this migration), each queued ticket's first queueing time (for the
# inspector's oldest wait), and, on PostgreSQL, the acquire that writes both. Both
# columns are nullable without a default: no table rewrite. The reverse restores
# 0006's acquire; the columns go after it.

from django.db import migrations, models

from django_syncguard.backends.database import sql

# The functions, from django_syncguard/backends/database/sql/0007/ (released files
# never change). Order matters: the ten-argument acquire becomes a wrapper of the
# eleven-argument one, which must exist first.
FORWARD = sql.load("0007", "acquire", "acquire_legacy")
REVERSE = sql.load("0007", "drop") + sql.load("0006", "acquire")


class Migration(migrations.Migration):
    dependencies = [("django_syncguard", "0006_fence_continuity")]

    operations = [
        migrations.AddField(
            model_name="lock",
            name="owner",
            field=models.TextField(null=True, blank=True),
        ),
        migrations.AddField(
            model_name="waiter",
            name="queued_at_ms",
            field=models.BigIntegerField(null=True),
        ),
        sql.run_on_postgresql(FORWARD, REVERSE),
    ]
