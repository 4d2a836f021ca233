"""Unit tests of dstl_ray.node."""
