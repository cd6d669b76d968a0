"""Reallocation: turning a role's weights in one layout into weights in another.

This version keeps every role in one layout, so the only reallocation is a full copy from one
role group to another of the same shape (the reference starts as a copy of the actor). It goes
through ``WeightCopy`` so that the sharded, collective-group path replaces it behind the same
call.
"""

from rayhf.realloc.copy import ObjectStoreCopy, ReallocStats, WeightCopy

__all__ = ["ObjectStoreCopy", "ReallocStats", "WeightCopy"]
