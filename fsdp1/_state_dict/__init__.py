"""State dicts and optimizer state dicts of both APIs: which form each unit's parameters take when
saved and loaded, and the settings that choose it.

Its rule: it imports the engine and ``api`` only; the fronts call it, it never reaches a front."""
