"""Running a lowered schedule on one rank: the executor, layer execution, SI lanes, pipeline transfers, recording."""
