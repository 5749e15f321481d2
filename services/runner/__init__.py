"""The runner: the process that serves one shard of a model from the log (pull a task, claim
it, fence its attempt, generate with an engine of ``inference/``, publish its chunks).

Outside the runner, only this package's names and its entry point (``main.run_runner``) are
imported: what a worker starts a runner with, and what it reads of one it outlived."""

from services.runner.claim import ACK_WAIT_S
from services.runner.consumers import tasks_consumer_name
from services.runner.current_tasks import CurrentTasks
from services.runner.spec import RunnerSpec

__all__ = ["ACK_WAIT_S", "CurrentTasks", "RunnerSpec", "tasks_consumer_name"]
