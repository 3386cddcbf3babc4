"""The main command's persistent compilation cache: where it points, and who wins."""

import os
from unittest import mock

import jax
from absl.testing import absltest

import looped_testing as testing
from looped import startup


class CompilationCacheTest(testing.TempDirTestCase):
  def setUp(self):
    super().setUp()
    before = jax.config.jax_compilation_cache_dir
    self.addCleanup(jax.config.update, "jax_compilation_cache_dir", before)

  def test_flag_sets_the_cache_when_the_environment_does_not(self):
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["HOME"] = self.tmp
    with mock.patch.dict(os.environ, env, clear=True):
      used = startup.enable_compilation_cache("~/cache")
    self.assertEqual(used, os.path.join(self.tmp, "cache"))
    self.assertEqual(jax.config.jax_compilation_cache_dir, used)

  def test_environment_wins_and_empty_turns_it_off(self):
    before = jax.config.jax_compilation_cache_dir
    with mock.patch.dict(os.environ, {"JAX_COMPILATION_CACHE_DIR": "/elsewhere"}):
      self.assertEqual(startup.enable_compilation_cache("~/cache"), "/elsewhere")
    self.assertEqual(jax.config.jax_compilation_cache_dir, before)
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    with mock.patch.dict(os.environ, env, clear=True):
      self.assertIsNone(startup.enable_compilation_cache(""))
    self.assertEqual(jax.config.jax_compilation_cache_dir, before)


if __name__ == "__main__":
  absltest.main()
