"""Unit tests of dstl_ray.transport."""
