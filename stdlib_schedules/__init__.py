"""The dhelix standard library: layer DAGs, pipeline schedules and hardware profiles (data)."""
