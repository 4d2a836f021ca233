"""Unit tests of dstl_ray.state."""
