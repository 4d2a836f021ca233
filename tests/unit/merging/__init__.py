"""Unit tests of dstl_ray.merging."""
