"""The trace-driven cluster simulator (`halfmoon sim`): the Conductor's own dispatcher, admission
and the kvpool's block pool, run against simulated workers on a simulated clock."""
