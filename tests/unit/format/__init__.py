"""Unit tests of dstl_ray.format."""
