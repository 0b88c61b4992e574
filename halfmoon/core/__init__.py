"""core: the vocabulary every room shares.

Base errors (`core.errors`), request parameters (`core.params`), the typed messages that cross a
process seam and the worker roles' protocols (`core.messages`), block arithmetic
(`core.blocks`). It imports nothing else of Halfmoon, so every package may import it.
"""
