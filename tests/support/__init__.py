"""What the tests run on: servers, backend harnesses, a fault proxy, worker processes
and factories. Nothing here is a test; the fixtures that use it are in
``tests/conftest.py``."""
