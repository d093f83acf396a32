"""How many tree nodes each step verifies; no vLLM here.

* :mod:`.costs`: cost curves of the target and of one draft level, measured or fixed.
* :mod:`.decisions`: the pure decisions (the draft's shape before drafting, the nodes per
  request after) from costs and an acceptance model.
* :mod:`.adaptive`: one engine's controller, feeding measurements into those decisions.
* :mod:`.summary`: what the budget did, for the engine's stats.
"""
