"""How many tree nodes each step verifies; no vLLM here.

* :mod:`.costs`: cost curves of the target and of one draft level, measured or fixed.
* :mod:`.prices`: what one engine has learnt from timings (curves, speeds, overheads).
* :mod:`.acceptance`: acceptance by tree position: the model the planner reads and the device table
  verification feeds.
* :mod:`.decisions`: the pure decisions (the draft's shape before drafting, the nodes per
  request after) from costs and acceptance.
* :mod:`.adaptive`: one engine's controller, feeding measurements into those decisions.
* :mod:`.summary`: what the budget did, for the engine's stats.
"""
