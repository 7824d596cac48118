"""Allocators for other libraries: gormm_rmm.allocators.torch and gormm_rmm.allocators.cupy."""
