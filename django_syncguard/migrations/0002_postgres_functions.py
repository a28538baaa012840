# PostgreSQL-only parts of the database backend's schema. A migration of its own:
# Django creates some indexes from deferred SQL at the end of a migration, so they
# only exist once 0001 has finished.

from django.db import migrations

from django_syncguard.backends.database import sql

# The functions, from django_syncguard/backends/database/sql/0002/ (see the docstring
# of that package: released files never change).
FORWARD = sql.load("0002", "acquire", "release", "extend")
REVERSE = sql.load("0002", "drop")


def _drop_like_indexes(apps, schema_editor):
    # Django adds varchar/text_pattern_ops ("_like") indexes for LIKE queries on
    # PostgreSQL. Lock operations only ever compare keys for equality: the extra
    # indexes would cost memory and write time per lock for nothing.
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexname FROM pg_indexes WHERE schemaname = current_schema() "
            "AND tablename IN ('syncguard_locks', 'syncguard_fence_counters') "
            "AND indexname LIKE '%%\\_like'"
        )
        names = [row[0] for row in cursor.fetchall()]
    for name in names:
        schema_editor.execute(f'DROP INDEX IF EXISTS "{name}"')


class Migration(migrations.Migration):
    dependencies = [("django_syncguard", "0001_initial")]

    operations = [
        migrations.RunPython(_drop_like_indexes, migrations.RunPython.noop),
        sql.run_on_postgresql(FORWARD, REVERSE),
    ]
