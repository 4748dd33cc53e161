def placement_dot(*a): return ""
