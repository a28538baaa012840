"""The example project's Celery app (only with the example's Celery extra installed:
``pip install -r example_project/requirements-celery.txt``).

Run a worker from ``example_project/`` with a redis-server on localhost (or
``CELERY_BROKER_URL`` naming another broker)::

    celery -A example_project worker --concurrency 2

then queue payments from ``manage.py shell``::

    from invoices.tasks import pay_invoice
    pay_invoice.delay(1, "shell")
"""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")

app = Celery("example_project")
# The CELERY_* settings (example_project/settings.py).
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
