# Celery's app, when the example's Celery extra is installed, so that `shared_task`
# (invoices/tasks.py) binds to it; `make demo` needs neither Celery nor a broker.
try:
    from .celery import app as celery_app
except ImportError:  # pragma: no cover - the extra is not installed
    pass
else:
    __all__ = ["celery_app"]
