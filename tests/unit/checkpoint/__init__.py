"""Unit tests of dstl_ray.checkpoint."""
