"""Lock backends. Each module is imported only when an alias names it."""
