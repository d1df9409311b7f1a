"""Terminal tasks: the native (Harbor / Terminal-Bench 2.x) layout, readers for older
layouts, a writer, and validation."""

from tmax.tasks.config import TaskConfig
from tmax.tasks.config_tables import DOMAINS
from tmax.tasks.model import FileSpec, Problem, Task, TaskDraft, TaskError
from tmax.tasks.native import find_tasks, load_task, validate_task, write_task
from tmax.tasks.readers import detect_format, read_any, read_tb1, read_tmax_v1

__all__ = [
    "DOMAINS", "FileSpec", "Problem", "Task", "TaskConfig", "TaskDraft", "TaskError",
    "detect_format", "find_tasks", "load_task", "read_any", "read_tb1", "read_tmax_v1",
    "validate_task", "write_task",
]
