"""Unit tests of dstl_ray.log."""
