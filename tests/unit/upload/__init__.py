"""Unit tests of dstl_ray.upload."""
