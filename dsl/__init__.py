"""The dhelix front end, planner and simulator (never imports torch)."""
