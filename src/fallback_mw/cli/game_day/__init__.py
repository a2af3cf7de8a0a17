"""`fallback-mw gameday`: a fault with written predictions and numeric abort criteria,
watched through the usage records every gateway process writes to the store."""
