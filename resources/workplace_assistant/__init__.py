"""workplace_assistant: a workplace (email, calendar, analytics, projects, CRM) the model acts on.

Matches NeMo Gym's ``workplace_assistant`` resources server (WorkBench). Each session
owns a fresh copy of the workplace state (``workbench.Workbench``: NeMo Gym's CSV
data); the 27 tools read and change it with NeMo Gym's semantics and answers.

``verify`` compares the session's final state with the state the task's
``ground_truth`` calls produce on a fresh copy: reward 1.0 iff all five compared
tables (calendar events, emails, plots, project tasks, CRM customers) are equal
after lowercasing every column except ``status``, ``list_name`` and ``board``
(``DataFrame.equals``: same rows, order, index and types). So any sequence of calls
reaching the ground truth's state scores 1 (read-only calls, an equivalent
``send_email`` for a ``reply_email``, independent updates in another order), while a
missing, extra or wrong change scores 0, and so do two ``create_event`` calls in
swapped order (their generated ids swap). No extra fields. ``reverify = "replay"``:
the session-less path rebuilds the session by running the response's calls first.

Tool calls follow NeMo Gym's conventions: arguments are a JSON object passed to the
operation as they are (no schema coercion; an unknown argument is the operation's
error); the answer is ``{"output": <result>}`` as compact JSON, and a failing
operation answers ``{"output": "Error executing tool '<name>': <error>"}``.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
from collections.abc import Callable
from typing import Any

import msgspec

from gym_runtime.messages import FunctionCall, Response
from gym_runtime.resource import Resource, decode_arguments, tool

from .workbench import OPERATIONS, READ_ONLY, Workbench, same_state


def _jsonable(value: Any) -> Any:
    """What NeMo Gym's JSON response makes of a tool result: NaN/inf become null, numpy scalars plain."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    item = getattr(value, "item", None)  # numpy scalar
    if callable(item) and type(value).__module__ == "numpy":
        return _jsonable(item())
    if value is not None and not isinstance(value, (str, int, bool)):
        return str(value)
    return value


def encode_output(result: Any) -> str:
    return json.dumps({"output": _jsonable(result)}, ensure_ascii=False, separators=(",", ":"))


# NeMo Gym's tool classes; a TypeError names the method as ``EmailTool.send_email()``.
_TOOL_CLASSES = {
    "company_directory": "CompanyDirectoryTool",
    "email": "EmailTool",
    "calendar": "CalendarTool",
    "analytics": "AnalyticsTool",
    "project_management": "ProjectManagementTool",
    "customer_relationship_manager": "CustomerRelationshipManagerTool",
}


def _as_nemo_gym_names(message: str, name: str) -> str:
    for prefix, cls in _TOOL_CLASSES.items():
        if name.startswith(prefix + "_"):
            return message.replace(f"Workbench.{name}()", f"{cls}.{name[len(prefix) + 1 :]}()")
    return message


def run_calls(bench: Workbench, calls: Any) -> None:
    """Apply calls the way NeMo Gym's verify replays them: arguments as given, failures skipped."""
    for call in calls:
        try:
            name = call["name"]
            if name not in OPERATIONS:
                continue
            getattr(bench, name)(**json.loads(call["arguments"]))
        except Exception:  # noqa: BLE001, S112 - a failing call changes nothing, as in NeMo Gym
            continue


def _operation(stub: Callable[..., Any]) -> Callable[..., Any]:
    """A tool that runs the ``Workbench`` operation of the stub's name with the stub's arguments.

    The stub's signature and docstring are what a model is offered (NeMo Gym's schemas: which
    arguments are required, and their types); its body is never run.
    """
    signature = inspect.signature(stub)

    @functools.wraps(stub)
    async def run(self: WorkplaceAssistant, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        del bound.arguments["self"]
        return await self._run(stub.__name__, **bound.arguments)

    return tool(run)


class WorkplaceTask(msgspec.Struct, kw_only=True):
    """The task fields verify reads: the reference calls."""

    ground_truth: list[dict[str, Any]]


class WorkplaceAssistant(Resource):
    """One instance per rollout: each has its own copy of the workplace."""

    task_fields = WorkplaceTask

    reverify = "replay"

    def __init__(self) -> None:
        self.bench: Workbench | None = None  # None: not seeded

    async def seed(self, task: dict[str, Any]) -> None:
        self.bench = Workbench()

    async def call_tool(self, name: str, arguments: str | bytes) -> str:
        """Run one operation on this session's state, with NeMo Gym's argument handling and answers.

        Read-only operations get the arguments without nulls (as NeMo Gym's tool route
        passes them); state-changing ones get them as written, as NeMo Gym's verify
        replays them, so the session ends in the state NeMo Gym grades.
        """
        kwargs = decode_arguments(name, arguments)
        if self.bench is None:
            self.bench = Workbench()
        if name in READ_ONLY:
            kwargs = {k: v for k, v in kwargs.items() if v is not None}
        try:
            if name not in OPERATIONS:
                raise KeyError(name)
            result = getattr(self.bench, name)(**kwargs)
        except Exception as e:  # noqa: BLE001 - shown to the model so it can correct itself (NeMo Gym's text)
            result = f"Error executing tool '{name}': {_as_nemo_gym_names(str(e), name)}"
        return encode_output(result)

    async def verify(self, task: dict[str, Any], response: Response) -> float:
        if "ground_truth" not in task:
            raise ValueError("task row needs 'ground_truth' (the reference calls)")
        predicted = self.bench
        if predicted is None:  # never seeded: rebuild the state from the response, as NeMo Gym's verify does
            predicted = Workbench()
            run_calls(
                predicted,
                [{"name": i.name, "arguments": i.arguments} for i in response.output if isinstance(i, FunctionCall)],
            )
        reference = Workbench()
        ground_truth = task["ground_truth"]
        run_calls(reference, ground_truth if isinstance(ground_truth, list) else [])
        return 1.0 if same_state(predicted, reference) else 0.0

    # ---- the tools, as offered to a model (call_tool above runs them; _operation below)

    @_operation
    def company_directory_find_email_address(self, name: str = "") -> Any:
        """Finds all email addresses containing the given name (case-insensitive search)."""

    @_operation
    def email_get_email_information_by_id(self, email_id: str, field: str) -> Any:
        """Retrieves specific details of an email by its ID."""

    @_operation
    def email_search_emails(
        self,
        query: str = "",
        date_min: str | None = None,
        date_max: str | None = None,
        page: int = 1,
        page_size: int = 5,
    ) -> Any:
        """Searches for emails matching the given query across subject, body, or sender fields. The function matches an email if all words in the query appear in any of these fields."""

    @_operation
    def email_send_email(self, recipient: str, subject: str, body: str) -> Any:
        """Sends an email to the specified recipient."""

    @_operation
    def email_delete_email(self, email_id: str) -> Any:
        """Deletes an email by its ID."""

    @_operation
    def email_forward_email(self, email_id: str, recipient: str) -> Any:
        """Forwards an email to the specified recipient."""

    @_operation
    def email_reply_email(self, email_id: str, body: str) -> Any:
        """Replies to an email by its ID."""

    @_operation
    def calendar_get_event_information_by_id(self, event_id: str, field: str) -> Any:
        """Returns the event for a given ID."""

    @_operation
    def calendar_search_events(
        self,
        query: str = "",
        time_min: str | None = None,
        time_max: str | None = None,
        page: int = 1,
        page_size: int = 5,
    ) -> Any:
        """Returns the events for a given query with pagination support."""

    @_operation
    def calendar_create_event(self, event_name: str, participant_email: str, event_start: str, duration: str) -> Any:
        """Creates a new event."""

    @_operation
    def calendar_delete_event(self, event_id: str) -> Any:
        """Deletes an event."""

    @_operation
    def calendar_update_event(self, event_id: str, field: str, new_value: str) -> Any:
        """Updates an event."""

    @_operation
    def analytics_get_visitor_information_by_id(self, visitor_id: str) -> Any:
        """Returns the analytics data for a given visitor ID."""

    @_operation
    def analytics_create_plot(self, time_min: str, time_max: str, value_to_plot: str, plot_type: str) -> Any:
        """Plots the analytics data for a given time range and value."""

    @_operation
    def analytics_total_visits_count(self, time_min: str | None = None, time_max: str | None = None) -> Any:
        """Returns the total number of visits within a specified time range."""

    @_operation
    def analytics_engaged_users_count(self, time_min: str | None = None, time_max: str | None = None) -> Any:
        """Returns the number of engaged users within a specified time range."""

    @_operation
    def analytics_traffic_source_count(
        self, time_min: str | None = None, time_max: str | None = None, traffic_source: str | None = None
    ) -> Any:
        """Returns the number of visits from a specific traffic source within a specified time range."""

    @_operation
    def analytics_get_average_session_duration(self, time_min: str | None = None, time_max: str | None = None) -> Any:
        """Returns the average session duration within a specified time range."""

    @_operation
    def project_management_get_task_information_by_id(self, task_id: str, field: str) -> Any:
        """Returns the task information for a given ID."""

    @_operation
    def project_management_search_tasks(
        self,
        task_name: str | None = None,
        assigned_to_email: str | None = None,
        list_name: str | None = None,
        due_date: str | None = None,
        board: str | None = None,
    ) -> Any:
        """Searches for tasks based on the given parameters."""

    @_operation
    def project_management_create_task(
        self, task_name: str, assigned_to_email: str, list_name: str, due_date: str, board: str
    ) -> Any:
        """Creates a new task."""

    @_operation
    def project_management_delete_task(self, task_id: str) -> Any:
        """Deletes a task by ID."""

    @_operation
    def project_management_update_task(self, task_id: str, field: str, new_value: str) -> Any:
        """Updates a task by ID."""

    @_operation
    def customer_relationship_manager_search_customers(
        self,
        customer_name: str | None = None,
        customer_email: str | None = None,
        product_interest: str | None = None,
        status: str | None = None,
        assigned_to_email: str | None = None,
        last_contact_date_min: str | None = None,
        last_contact_date_max: str | None = None,
        follow_up_by_min: str | None = None,
        follow_up_by_max: str | None = None,
        page: int = 1,
        page_size: int = 5,
    ) -> Any:
        """Searches for customers based on the given parameters with pagination support."""

    @_operation
    def customer_relationship_manager_update_customer(self, customer_id: str, field: str, new_value: str) -> Any:
        """Updates a customer record by ID."""

    @_operation
    def customer_relationship_manager_add_customer(
        self,
        customer_name: str,
        assigned_to_email: str,
        status: str,
        customer_email: str | None = None,
        customer_phone: str | None = None,
        last_contact_date: str | None = None,
        product_interest: str | None = None,
        notes: str = "",
        follow_up_by: str | None = None,
    ) -> Any:
        """Adds a new customer record."""

    @_operation
    def customer_relationship_manager_delete_customer(self, customer_id: str) -> Any:
        """Deletes a customer record by ID."""

    async def _run(self, name: str, /, **kwargs: Any) -> Any:
        """Direct Python use of a tool method: the operation's result (not JSON-encoded)."""
        if self.bench is None:
            self.bench = Workbench()
        return getattr(self.bench, name)(**kwargs)
