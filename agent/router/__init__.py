"""Length-aware pool router with application-level fairness."""
