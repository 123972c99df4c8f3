"""``scheme="zen"``: ZEN's Balanced Parallelism (OSDI 2025), one module per concept:

    scheme.py   the protocol's steps (partition, agree and push, aggregate, pull), the settings, the dense switch
    push.py     the push: its COO pieces, the plan of the slots they ride in inside the agreement, the
                all-to-all of what outgrows them, and the tensor whole in those slots after a dense call
    pull.py     the pull: COO or hash bitmap over I_j (the cached index sets), rooms sized alike on every rank
                with no round for sizes, the exchange and its decoding
    cost.py     the cost formulas (phases, memory) and the rules the protocol shares with them: the slot rule
                (slot_count) and the dense switch (go_dense, goes_whole, WHOLE_BYTES)

The agreement (:mod:`zen.agreement`) carries the push's first bytes in slots it knows nothing about: this
package sizes them, files their plan and reads them back.
"""
from .scheme import BalancedParallelism, check_settings

__all__ = ["BalancedParallelism", "check_settings"]
