"""The named pass pipeline over the Program: shapes, autodiff, strands, fold, lower, validate, unit time and dumps."""
