"""`folio bench parallel`: a model whole and split over tensor, pipeline and context-parallel ranks."""
