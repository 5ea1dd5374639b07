"""Level-based reconcile loops of the controller: read the whole state, decide, apply."""
