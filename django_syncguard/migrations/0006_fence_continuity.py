# Fence continuity (django_syncguard/fence_floors.py; specs/backends/database.md, Fence
# continuity): each counter's last acquisition time, for compaction's cut-off (NULL for
# counters written before this migration: 8 bytes per counter, no table rewrite), and,
# on PostgreSQL, the acquire that reads the fence floor and applies the fence mode. The
# reverse restores 0005's acquire; the column goes after it.

from django.db import migrations, models

from django_syncguard.backends.database import sql

# The functions, from django_syncguard/backends/database/sql/0006/ (see the docstring
# of that package: released files never change). Order matters: the nine-argument
# acquire becomes a wrapper of the ten-argument one, which must exist first.
FORWARD = sql.load("0006", "acquire", "acquire_legacy")
REVERSE = sql.load("0006", "drop") + sql.load("0005", "acquire")


class Migration(migrations.Migration):
    dependencies = [("django_syncguard", "0005_postgres_queue_functions")]

    operations = [
        migrations.AddField(
            model_name="fencecounter",
            name="acquired_at_ms",
            field=models.BigIntegerField(null=True),
        ),
        sql.run_on_postgresql(FORWARD, REVERSE),
    ]
