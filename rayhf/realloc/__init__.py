"""Reallocation: plan which weight slices move between layouts, then move them.

``rayhf.realloc.plan`` is pure (no Ray, no processes); ``transport`` moves slices inside the
actors; ``mover`` is the driver side (it imports Ray, so it is not imported here).
"""

from rayhf.realloc.plan import ReallocPlan, Transfer, check_compatible, plan_realloc

__all__ = ["ReallocPlan", "Transfer", "check_compatible", "plan_realloc"]
