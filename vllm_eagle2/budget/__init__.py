"""How many tree nodes each step verifies; no vLLM here.

* :mod:`.costs`: cost curves of the target and of one draft level, measured or fixed.
* :mod:`.prices`: what one engine has learnt from timings (curves, speeds, overheads).
* :mod:`.acceptance`: acceptance by tree position: the model the planner reads and the device table
  verification feeds.
* :mod:`.decisions`: the pure decisions (the draft's shape before drafting, the nodes per
  request after) from costs and acceptance.
* :mod:`.timing`: one step's record (its timings, what it sent), which the step marks as it runs.
* :mod:`.adaptive`: one engine's controller, three calls a step: ``learn`` (from the record of the
  step before), ``plan`` and the plan's ``allocate``.
* :mod:`.summary`: what the budget did, for the engine's stats.
"""
