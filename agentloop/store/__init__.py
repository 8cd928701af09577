"""The store: ORM models and the only module that issues SQL."""

from agentloop.store.store import BudgetExceeded, Conflict, Store, new_id, utcnow

__all__ = ["BudgetExceeded", "Conflict", "Store", "new_id", "utcnow"]
