"""The workplace state (WorkBench's five tables) and the 27 operations on it.

A re-implementation of the semantics of NeMo Gym's ``workplace_assistant`` tools,
message for message: the same validations in the same order, the same answer
strings, the same id generation, and the same pandas operations wherever pandas'
behaviour decides the outcome (``str.contains`` is a case-insensitive *regex*
search, ``pd.Timestamp`` parses dates, ``max()`` of an id column is a string
maximum, appended rows keep or renumber the index as NeMo Gym's ``concat`` does).
State equality in ``verify`` is ``DataFrame.equals`` after lowercasing, so the
index, row order and dtypes must come out as NeMo Gym's do; pandas 3 is required.

The tables are loaded once per process from ``data/state/`` (NeMo Gym's CSV data);
every session gets shallow copies, which pandas' copy-on-write keeps independent.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import pandas as pd

STATE_DIR = Path(__file__).resolve().parent / "data" / "state"
# The environment's "now"; a sent email is stamped with it.
CURRENT_TIME = pd.to_datetime("2023-11-30T23:59:00")
# Columns compared case-sensitively in verify; every other column is lowercased first.
CASE_SENSITIVE = frozenset({"status", "list_name", "board"})

PLOT_VALUES = (
    "total_visits",
    "session_duration_seconds",
    "user_engaged",
    "visits_direct",
    "visits_referral",
    "visits_search_engine",
    "visits_social_media",
)
PLOT_TYPES = ("bar", "line", "scatter", "histogram")
EVENT_FIELDS = ("event_id", "event_name", "participant_email", "event_start", "duration")
STATUSES = ("Qualified", "Won", "Lost", "Lead", "Proposal")
PRODUCTS = ("Software", "Hardware", "Services", "Consulting", "Training")
LISTS = ("Backlog", "In Progress", "In Review", "Completed")
BOARDS = ("Back end", "Front end", "Design")
CRM_FIELDS_MSG = (
    "Field not valid. Please choose from: 'customer_name', 'assigned_to_email', 'customer_email', "
    "'customer_phone', 'last_contact_date', 'product_interest', 'status', 'notes', 'follow_up_by'"
)
EMAIL_PATTERN = r"^[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\.[a-zA-Z]{2,}$"

# Operations that only read; the others change the compared state.
READ_ONLY = frozenset(
    {
        "company_directory_find_email_address",
        "email_get_email_information_by_id",
        "email_search_emails",
        "calendar_get_event_information_by_id",
        "calendar_search_events",
        "analytics_get_visitor_information_by_id",
        "analytics_total_visits_count",
        "analytics_engaged_users_count",
        "analytics_traffic_source_count",
        "analytics_get_average_session_duration",
        "project_management_get_task_information_by_id",
        "project_management_search_tasks",
        "customer_relationship_manager_search_customers",
    }
)


@functools.lru_cache(maxsize=1)
def _initial() -> dict[str, pd.DataFrame]:
    """The seeded tables, read once per process (as strings, like NeMo Gym).

    Strings are stored as Python objects whatever is installed: with pyarrow present,
    pandas would otherwise search them with RE2, whose syntax and errors differ from
    Python's ``re`` that NeMo Gym's tools answer with.
    """
    with pd.option_context("mode.string_storage", "python"):
        return _read_tables()


def _read_tables() -> dict[str, pd.DataFrame]:
    analytics = pd.read_csv(STATE_DIR / "analytics_data.csv", dtype=str)
    analytics["user_engaged"] = analytics["user_engaged"] == "True"
    return {
        "emails": pd.read_csv(STATE_DIR / "emails.csv", dtype=str),
        "calendar": pd.read_csv(STATE_DIR / "calendar_events.csv", dtype=str),
        "analytics": analytics,
        "plots": pd.DataFrame(columns=["file_path"]),
        "tasks": pd.read_csv(STATE_DIR / "project_tasks.csv", dtype=str),
        "crm": pd.read_csv(STATE_DIR / "customer_relationship_manager_data.csv", dtype=str),
        "directory": pd.read_csv(STATE_DIR / "email_addresses.csv", header=None, names=["email_address"]),
    }


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    return frame.to_dict(orient="records")


def _page(items: list[Any], page: Any, page_size: Any) -> tuple[list[Any], dict[str, Any]]:
    """One page of ``items`` and the pagination block (the page is clamped into range)."""
    total = len(items)
    pages = (total + page_size - 1) // page_size
    page = max(1, min(page, pages)) if pages > 0 else 1
    start = (page - 1) * page_size
    return items[start : min(start + page_size, total)], {"page": page, "page_size": page_size, "total_pages": pages}


def _eight_digits(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 8 and value.isdigit()


def _next_id(frame: pd.DataFrame, column: str) -> str:
    """One more than the largest id (a *string* maximum), zero-padded to 8 digits."""
    return str(int(frame[column].max()) + 1).zfill(8)


def _dated(frame: pd.DataFrame, column: str, low: Any, high: Any) -> pd.DataFrame:
    """Rows whose ``column`` (a date string) lies in [low, high], compared as strings."""
    if low:
        frame = frame[frame[column] >= low]
    if high:
        frame = frame[frame[column] <= high]
    return frame


class Workbench:
    """One session's state. Method names are the tool names; arguments as NeMo Gym passes them."""

    def __init__(self) -> None:
        tables = _initial()
        self.emails = tables["emails"].copy(deep=False)
        self.calendar = tables["calendar"].copy(deep=False)
        self.analytics = tables["analytics"].copy(deep=False)
        self.plots = tables["plots"].copy(deep=False)
        self.tasks = tables["tasks"].copy(deep=False)
        self.crm = tables["crm"].copy(deep=False)
        self.directory = tables["directory"]  # never written

    def compared_tables(self) -> dict[str, pd.DataFrame]:
        return {
            "calendar": self.calendar,
            "email": self.emails,
            "analytics": self.plots,
            "project_management": self.tasks,
            "customer_relationship_manager": self.crm,
        }

    # ------------------------------------------------------------------ directory

    def company_directory_find_email_address(self, name=""):
        if name == "":
            return "Name not provided."
        addresses = self.directory["email_address"]
        return addresses[addresses.str.contains(name.lower(), case=False)].values.tolist()

    # ---------------------------------------------------------------------- email

    def email_get_email_information_by_id(self, email_id=None, field=None):
        if not email_id:
            return "Email ID not provided."
        if not field:
            return "Field not provided."
        try:
            found = _records(self.emails[self.emails["email_id"] == email_id])
            if not found:
                return "Email not found."
            if field not in found[0]:
                return f"Field '{field}' not found. Available fields: {', '.join(found[0])}"
            return {field: found[0][field]}
        except Exception as e:  # noqa: BLE001 - NeMo Gym reports these as text
            return f"Error retrieving email information: {e}"

    def email_search_emails(self, query="", date_min=None, date_max=None, page=1, page_size=5):
        try:
            words = query.lower().split()
            rows = zip(self.emails["subject"], self.emails["body"], self.emails["sender/recipient"])
            keep = [all(w in f"{s} {b} {r}".lower() for w in words) for s, b, r in rows]
            hits = self.emails[pd.Series(keep, index=self.emails.index, dtype=bool)].copy()
            hits["_sent"] = pd.to_datetime(hits["sent_datetime"])
            found = _records(hits.sort_values("_sent", ascending=False).drop(columns=["_sent"]))
            # A bound is parsed only when there is an email to compare it with (as in NeMo Gym).
            if date_min and found:
                low = pd.Timestamp(date_min).date()
                found = [e for e in found if pd.Timestamp(e["sent_datetime"]).date() >= low]
            if date_max and found:
                high = pd.Timestamp(date_max).date()
                found = [e for e in found if pd.Timestamp(e["sent_datetime"]).date() <= high]
            shown, pagination = _page(found, page, page_size)
            if not found:
                return "No emails found."
            return {"emails": shown, "pagination": {"total_emails": len(found), **pagination}}
        except Exception as e:  # noqa: BLE001
            return f"Error searching emails: {e}"

    def email_send_email(self, recipient=None, subject=None, body=None):
        if not recipient or not subject or not body:
            return "Recipient, subject, or body not provided."
        if "@" not in recipient or "." not in recipient:
            return "Invalid recipient email address."
        try:
            row = {
                "email_id": str(int(self.emails["email_id"].max()) + 1) if not self.emails.empty else "1",
                "inbox/outbox": "outbox",
                "sender/recipient": recipient.lower(),
                "subject": subject,
                "sent_datetime": str(CURRENT_TIME),
                "body": body,
            }
            self.emails = pd.concat([self.emails, pd.DataFrame([row])], ignore_index=True)
            return "Email sent successfully."
        except Exception as e:  # noqa: BLE001
            return f"Error sending email: {e}"

    def email_delete_email(self, email_id=None):
        if not email_id:
            return "Email ID not provided."
        try:
            if email_id not in self.emails["email_id"].values:
                return "Email not found."
            self.emails = self.emails[self.emails["email_id"] != email_id]
            return "Email deleted successfully."
        except Exception as e:  # noqa: BLE001
            return f"Error deleting email: {e}"

    def _send_based_on(self, email_id, recipient, prefix, body, done, failed):
        """Forward and reply: send a new email built from an existing one."""
        try:
            if email_id not in self.emails["email_id"].values:
                return "Email not found."
            original = _records(self.emails[self.emails["email_id"] == email_id])[0]
            to = original["sender/recipient"] if recipient is None else recipient.lower()
            sent = self.email_send_email(
                to, f"{prefix}: {original['subject']}", original["body"] if body is None else body
            )
            return sent if "Error" in sent or "Invalid" in sent else done
        except Exception as e:  # noqa: BLE001
            return f"{failed}: {e}"

    def email_forward_email(self, email_id=None, recipient=None):
        if not email_id or not recipient:
            return "Email ID or recipient not provided."
        if "@" not in recipient or "." not in recipient:
            return "Invalid recipient email address."
        return self._send_based_on(
            email_id, recipient, "FW", None, "Email forwarded successfully.", "Error forwarding email"
        )

    def email_reply_email(self, email_id=None, body=None):
        if not email_id or not body:
            return "Email ID or body not provided."
        return self._send_based_on(email_id, None, "RE", body, "Email replied successfully.", "Error replying to email")

    # ------------------------------------------------------------------- calendar

    def calendar_get_event_information_by_id(self, event_id=None, field=None):
        if not event_id:
            return "Event ID not provided."
        if not field:
            return "Field not provided."
        if not _eight_digits(event_id):
            return "Invalid event ID format. Expected 8-digit ID."
        if field not in EVENT_FIELDS:
            return f"Invalid field. Available fields are: {', '.join(EVENT_FIELDS)}"
        found = _records(self.calendar[self.calendar["event_id"] == event_id])
        if not found:
            return "Event not found."
        return {field: found[0][field]} if field in found[0] else "Field not found."

    def calendar_search_events(self, query="", time_min=None, time_max=None, page=1, page_size=5):
        bounds = []
        for name, value in (("time_min", time_min), ("time_max", time_max)):
            if value:
                try:
                    value = pd.Timestamp(value)
                except ValueError:
                    return f"Invalid {name} format. Expected YYYY-MM-DD HH:MM:SS."
            bounds.append(value)
        low, high = bounds
        events = self.calendar
        matches = events["event_name"].str.contains(query, case=False, na=False) | events[
            "participant_email"
        ].str.contains(query, case=False, na=False)
        found = _records(events[matches])
        if low:
            found = [e for e in found if pd.Timestamp(e["event_start"]) >= low]
        if high:
            found = [e for e in found if pd.Timestamp(e["event_start"]) <= high]
        if not found:
            return "No events found."
        found.sort(key=lambda e: pd.Timestamp(e["event_start"]), reverse=True)
        shown, pagination = _page(found, page, page_size)
        return {"events": shown, "pagination": {"total_events": len(found), **pagination}}

    def _check_event_value(self, field, value):
        """The refusal for a bad start time or duration, or None."""
        if field == "event_start":
            try:
                pd.Timestamp(value)
            except ValueError:
                return "Invalid event_start format. Expected YYYY-MM-DD HH:MM:SS."
        elif field == "duration":
            try:
                if int(value) <= 0:
                    return "Duration must be a positive number of minutes."
            except ValueError:
                return "Invalid duration format. Expected a number of minutes."
        return None

    def calendar_create_event(self, event_name=None, participant_email=None, event_start=None, duration=None):
        for value, what in (
            (event_name, "Event name"),
            (participant_email, "Participant email"),
            (event_start, "Event start"),
            (duration, "Event duration"),
        ):
            if not value:
                return f"{what} not provided."
        refusal = self._check_event_value("event_start", event_start) or self._check_event_value("duration", duration)
        if refusal:
            return refusal
        event_id = _next_id(self.calendar, "event_id")
        row = pd.DataFrame(
            {
                "event_id": [event_id],
                "event_name": [event_name],
                "participant_email": [participant_email.lower()],
                "event_start": [event_start],
                "duration": [duration],
            }
        )
        self.calendar = pd.concat([self.calendar, row])  # NeMo Gym keeps the new row's own index (0)
        return event_id

    def calendar_delete_event(self, event_id=None):
        if not event_id:
            return "Event ID not provided."
        if not _eight_digits(event_id):
            return "Invalid event ID format. Expected 8-digit ID."
        if event_id not in self.calendar["event_id"].values:
            return "Event not found."
        self.calendar = self.calendar[self.calendar["event_id"] != event_id]
        return "Event deleted successfully."

    def calendar_update_event(self, event_id=None, field=None, new_value=None):
        if not event_id or not field or not new_value:
            return "Event ID, field, or new value not provided."
        if not _eight_digits(event_id):
            return "Invalid event ID format. Expected 8-digit ID."
        if field not in EVENT_FIELDS[1:]:
            return f"Invalid field. Available fields are: {', '.join(EVENT_FIELDS[1:])}"
        refusal = self._check_event_value(field, new_value)
        if refusal:
            return refusal
        if event_id not in self.calendar["event_id"].values:
            return "Event not found."
        if field == "participant_email":
            new_value = new_value.lower()
        self.calendar.loc[self.calendar["event_id"] == event_id, field] = new_value
        return "Event updated successfully."

    # ------------------------------------------------------------------ analytics

    def analytics_get_visitor_information_by_id(self, visitor_id=None):
        if not visitor_id:
            return "Visitor ID not provided."
        found = _records(self.analytics[self.analytics["visitor_id"] == visitor_id])
        return found or "Visitor not found."

    def analytics_create_plot(self, time_min=None, time_max=None, value_to_plot=None, plot_type=None):
        if not time_min:
            return "Start date not provided."
        if not time_max:
            return "End date not provided."
        if value_to_plot not in PLOT_VALUES:
            return "Value to plot must be one of " + ", ".join(f"'{v}'" for v in PLOT_VALUES)
        if plot_type not in PLOT_TYPES:
            return "Plot type must be one of 'bar', 'line', 'scatter', or 'histogram'"
        path = f"plots/{time_min}_{time_max}_{value_to_plot}_{plot_type}.png"
        self.plots.loc[len(self.plots)] = [path]
        return path

    def analytics_total_visits_count(self, time_min=None, time_max=None):
        return _dated(self.analytics, "date_of_visit", time_min, time_max).groupby("date_of_visit").size().to_dict()

    def _per_day_sum(self, time_min, time_max, column, make):
        data = _dated(self.analytics[:], "date_of_visit", time_min, time_max)
        data[column] = make(data)
        return data.groupby("date_of_visit").sum()[column].to_dict()

    def analytics_engaged_users_count(self, time_min=None, time_max=None):
        return self._per_day_sum(
            time_min, time_max, "user_engaged", lambda d: d["user_engaged"].astype(bool).astype(int)
        )

    def analytics_traffic_source_count(self, time_min=None, time_max=None, traffic_source=None):
        if not traffic_source:
            return self.analytics_total_visits_count(time_min, time_max)
        return self._per_day_sum(
            time_min, time_max, "visits_from_source", lambda d: (d["traffic_source"] == traffic_source).astype(int)
        )

    def analytics_get_average_session_duration(self, time_min=None, time_max=None):
        # Without bounds this is the session's own table, and NeMo Gym converts that column in place.
        data = _dated(self.analytics, "date_of_visit", time_min, time_max)
        data["session_duration_seconds"] = data["session_duration_seconds"].astype(float)
        means = data[["date_of_visit", "session_duration_seconds"]].groupby("date_of_visit").mean()
        return means["session_duration_seconds"].to_dict()

    # --------------------------------------------------------- project management

    def project_management_get_task_information_by_id(self, task_id=None, field=None):
        if not task_id:
            return "Task ID not provided."
        if not field:
            return "Field not provided."
        found = _records(self.tasks[self.tasks["task_id"] == task_id])
        if not found:
            return "Task not found."
        return {field: found[0][field]} if field in found[0] else "Field not found."

    def project_management_search_tasks(
        self, task_name=None, assigned_to_email=None, list_name=None, due_date=None, board=None
    ):
        if not any([task_name, assigned_to_email, list_name, due_date, board]):
            return "No search parameters provided."
        if assigned_to_email and not re.match(EMAIL_PATTERN, assigned_to_email):
            return "Invalid email format for assigned_to_email."
        tasks = self.tasks
        if task_name:
            tasks = tasks[tasks["task_name"].str.contains(task_name, case=False)]
        if assigned_to_email:
            tasks = tasks[tasks["assigned_to_email"].str.lower() == assigned_to_email.lower()]
        for column, value in (("list_name", list_name), ("due_date", due_date), ("board", board)):
            if value:
                tasks = tasks[tasks[column].str.contains(value, case=False)]
        return _records(tasks)

    def _assignee_known(self, email):
        return email in self.tasks["assigned_to_email"].str.lower().values

    def project_management_create_task(
        self, task_name=None, assigned_to_email=None, list_name=None, due_date=None, board=None
    ):
        if not all([task_name, assigned_to_email, list_name, due_date, board]):
            return "Missing task details."
        assigned_to_email = assigned_to_email.lower()
        if not self._assignee_known(assigned_to_email):
            return "Assignee email not valid. Please choose from the list of team members."
        if list_name not in LISTS:
            return "List not valid. Please choose from: 'Backlog', 'In Progress', 'In Review', 'Completed'."
        if board not in BOARDS:
            return "Board not valid. Please choose from: 'Back end', 'Front end', 'Design'."
        task_id = _next_id(self.tasks, "task_id")
        row = pd.DataFrame(
            {
                "task_id": [task_id],
                "task_name": [task_name],
                "assigned_to_email": [assigned_to_email],
                "list_name": [list_name],
                "due_date": [due_date],
                "board": [board],
            }
        )
        self.tasks = pd.concat([self.tasks, row], ignore_index=True)
        return task_id

    def project_management_delete_task(self, task_id=None):
        if not task_id:
            return "Task ID not provided."
        if task_id not in self.tasks["task_id"].values:
            return "Task not found."
        self.tasks = self.tasks[self.tasks["task_id"] != task_id]
        return "Task deleted successfully."

    def project_management_update_task(self, task_id=None, field=None, new_value=None):
        if not task_id or not field or not new_value:
            return "Task ID, field, or new value not provided."
        if field == "assigned_to_email":
            new_value = new_value.lower()
        if field == "board" and new_value not in BOARDS:
            return "Board not valid. Please choose from: 'Back end', 'Front end', 'Design'."
        if field == "list_name" and new_value not in LISTS:
            return "List not valid. Please choose from: 'Backlog', 'In Progress', 'In Review', 'Completed'."
        if field == "assigned_to_email" and not self._assignee_known(new_value):
            return "Assignee email not valid. Please choose from the list of team members."
        if task_id not in self.tasks["task_id"].values:
            return "Task not found."
        if field not in self.tasks.columns:
            return "Field not valid."
        self.tasks.loc[self.tasks["task_id"] == task_id, field] = new_value
        return "Task updated successfully."

    # ------------------------------------------------------------------------ CRM

    def customer_relationship_manager_search_customers(
        self,
        customer_name=None,
        customer_email=None,
        product_interest=None,
        status=None,
        assigned_to_email=None,
        last_contact_date_min=None,
        last_contact_date_max=None,
        follow_up_by_min=None,
        follow_up_by_max=None,
        page=1,
        page_size=5,
    ):
        contains = {
            "customer_name": customer_name,
            "customer_email": customer_email,
            "product_interest": product_interest,
            "status": status,
            "assigned_to_email": assigned_to_email,
        }
        dates = (last_contact_date_min, last_contact_date_max, follow_up_by_min, follow_up_by_max)
        if not any([*contains.values(), *dates]):
            return "No search parameters provided. Please provide at least one parameter."
        customers = self.crm
        for column, value in contains.items():
            if value:
                customers = customers[customers[column].str.contains(value, case=False)]
        customers = _dated(customers, "last_contact_date", last_contact_date_min, last_contact_date_max)
        customers = _dated(customers, "follow_up_by", follow_up_by_min, follow_up_by_max)
        found = _records(customers)
        shown, pagination = _page(found, page, page_size)
        if not found:
            return "No customers found."
        return {"customers": shown, "pagination": {"total_customers": len(found), **pagination}}

    def customer_relationship_manager_update_customer(self, customer_id=None, field=None, new_value=None):
        if not customer_id or not field or not new_value:
            return "Customer ID, field, or new value not provided."
        if field == "status" and new_value not in STATUSES:
            return "Status not valid. Please choose from: 'Qualified', 'Won', 'Lost', 'Lead', 'Proposal'"
        if field == "product_interest" and new_value not in PRODUCTS:
            return "Product interest not valid. Please choose from: 'Software', 'Hardware', 'Services', 'Consulting', 'Training'"
        if field in ("customer_email", "assigned_to_email"):
            new_value = new_value.lower()
        if customer_id not in self.crm["customer_id"].values:
            return "Customer not found."
        if field not in self.crm.columns:
            return CRM_FIELDS_MSG
        self.crm.loc[self.crm["customer_id"] == customer_id, field] = new_value
        return "Customer updated successfully."

    def customer_relationship_manager_add_customer(
        self,
        customer_name=None,
        assigned_to_email=None,
        status=None,
        customer_email=None,
        customer_phone=None,
        last_contact_date=None,
        product_interest=None,
        notes="",
        follow_up_by=None,
    ):
        if not all([customer_name, assigned_to_email, status]):
            return "Please provide all required fields: customer_name, assigned_to_email, status."
        assigned_to_email = assigned_to_email.lower()
        if customer_email:
            customer_email = customer_email.lower()
        customer_id = _next_id(self.crm, "customer_id")
        row = pd.DataFrame(
            {
                "customer_id": [customer_id],
                "customer_name": [customer_name],
                "customer_email": [customer_email],
                "customer_phone": [customer_phone],
                "last_contact_date": [last_contact_date],
                "product_interest": [product_interest],
                "status": [status],
                "assigned_to_email": [assigned_to_email],
                "notes": [notes],
                "follow_up_by": [follow_up_by],
            }
        )
        self.crm = pd.concat([self.crm, row], ignore_index=True)
        return customer_id

    def customer_relationship_manager_delete_customer(self, customer_id=None):
        if not customer_id:
            return "Customer ID not provided."
        if customer_id not in self.crm["customer_id"].values:
            return "Customer not found."
        self.crm = self.crm[self.crm["customer_id"] != customer_id]
        return "Customer deleted successfully."


OPERATIONS = frozenset(name for name in vars(Workbench) if not name.startswith("_") and name != "compared_tables")


def _lowercased(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with every column but the case-sensitive ones lowercased (non-strings become NaN)."""
    out = frame.copy()
    for column in out.columns:
        if column not in CASE_SENSITIVE:
            out[column] = out[column].str.lower()
    return out


def same_state(a: Workbench, b: Workbench) -> bool:
    """NeMo Gym's state comparison: every table equal (``DataFrame.equals``) after lowercasing."""
    left = {k: _lowercased(v) for k, v in a.compared_tables().items()}
    right = {k: _lowercased(v) for k, v in b.compared_tables().items()}
    return all(
        left[k].equals(right[k])
        for k in ("calendar", "email", "analytics", "project_management", "customer_relationship_manager")
    )
