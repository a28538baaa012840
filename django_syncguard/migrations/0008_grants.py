# Grants (specs/decisions.md, 48; specs/backends/database.md, Grants): a release hands
# the key to the first live waiter in its own transaction. Each queued ticket keeps the
# lock its attempt would write (the grant record), each lock row says which ticket it
# was granted to and, until that waiter's process claims it, the expiry its holder was
# told. Every column is nullable without a default: no table rewrite. On PostgreSQL, the
# functions that grant and claim (sql/0008/); the functions of code deployed before this
# version keep their signatures and never write a grant record. The reverse restores
# the functions 0008 replaced; the columns go after them.

from django.db import migrations, models

from django_syncguard.backends.database import sql

# The functions, from django_syncguard/backends/database/sql/0008/ (released files
# never change). Order matters: a LANGUAGE sql wrapper is checked against the function
# it calls when it is created, so each new function comes before its wrapper.
FORWARD = sql.load(
    "0008",
    "hand_over",
    "acquire",
    "acquire_legacy",
    "release",
    "release_legacy",
    "withdraw",
    "extend",
    "claim",
)
REVERSE = (
    sql.load("0008", "drop")
    + sql.load("0007", "acquire")
    + sql.load("0005", "release", "withdraw")
    + sql.load("0002", "extend")
)


class Migration(migrations.Migration):
    dependencies = [("django_syncguard", "0007_owners")]

    operations = [
        migrations.AddField(
            model_name="lock",
            name="granted_to",
            field=models.CharField(max_length=22, null=True, blank=True),
        ),
        migrations.AddField(
            model_name="lock",
            name="grant_expires_at_ms",
            field=models.BigIntegerField(null=True),
        ),
        migrations.AddField(
            model_name="waiter",
            name="lock_id",
            field=models.CharField(max_length=22, null=True),
        ),
        migrations.AddField(
            model_name="waiter",
            name="ttl_ms",
            field=models.BigIntegerField(null=True),
        ),
        migrations.AddField(
            model_name="waiter",
            name="fence_key",
            field=models.TextField(null=True),
        ),
        migrations.AddField(
            model_name="waiter",
            name="user_key",
            field=models.TextField(null=True),
        ),
        migrations.AddField(
            model_name="waiter",
            name="owner",
            field=models.TextField(null=True),
        ),
        migrations.AddField(
            model_name="waiter",
            name="clock",
            field=models.BooleanField(null=True),
        ),
        migrations.AddField(
            model_name="waiter",
            name="max_fence",
            field=models.BigIntegerField(null=True),
        ),
        migrations.AddField(
            model_name="waiter",
            name="grant_window_ms",
            field=models.BigIntegerField(null=True),
        ),
        sql.run_on_postgresql(FORWARD, REVERSE),
    ]
