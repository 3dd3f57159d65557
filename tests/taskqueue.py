"""A task backend for the tests (Django 6.0 and later) that does what a
backend with workers does, the worker run by hand: a task enqueued is kept,
by its path and with its arguments, as JSON, as a queue's store keeps it,
and :meth:`QueueBackend.work` runs what is queued, as a worker would, its
result kept as JSON too."""

from __future__ import annotations

import json
from typing import Any

from django.tasks import Task, TaskResult, TaskResultStatus
from django.tasks.backends.base import BaseTaskBackend
from django.utils import timezone
from django.utils.crypto import get_random_string
from django.utils.module_loading import import_string


class QueueBackend(BaseTaskBackend):
    supports_get_result = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.queued: list[str] = []
        self.results: dict[str, TaskResult] = {}

    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        self.validate_task(task)
        result = TaskResult(
            task=task,
            id=get_random_string(32),
            status=TaskResultStatus.READY,
            enqueued_at=timezone.now(),
            started_at=None,
            last_attempted_at=None,
            finished_at=None,
            args=args,
            kwargs=kwargs,
            backend=self.alias,
            errors=[],
            worker_ids=[],
        )
        self.results[result.id] = result
        self.queued.append(
            json.dumps(
                {
                    "id": result.id,
                    "task": task.module_path,
                    "args": result.args,
                    "kwargs": result.kwargs,
                }
            )
        )
        return result

    def get_result(self, result_id: str) -> TaskResult:
        return self.results[result_id]

    def work(self) -> int:
        """Run what is queued, oldest first, as a worker takes it from the
        store; how many ran. What a task raises is let through."""
        ran = 0
        while self.queued:
            stored = json.loads(self.queued.pop(0))
            result = self.results[stored["id"]]
            task = import_string(stored["task"])
            object.__setattr__(result, "status", TaskResultStatus.RUNNING)
            object.__setattr__(result, "started_at", timezone.now())
            value = task.call(*stored["args"], **stored["kwargs"])
            object.__setattr__(result, "_return_value", json.loads(json.dumps(value)))
            object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
            object.__setattr__(result, "finished_at", timezone.now())
            ran += 1
        return ran
