"""Celery configuration for a ``celery`` command run from the checkout (``celery --config
celeryconfig``). The configuration itself is ``worker/celery_config.py``, part of the installed
package, which is what the Proofline app loads: it never depends on the current directory."""

from worker.celery_config import *  # noqa: F403 - the same settings under the layout's name
