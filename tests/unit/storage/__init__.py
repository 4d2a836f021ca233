"""Unit tests of dstl_ray.storage."""
