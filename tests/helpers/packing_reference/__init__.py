"""The planners and packers as they were before vectorization (main at fbf9ff7), kept only as the reference that
``tests/test_planning_vectorized.py`` checks the array implementations against, field by field. Not used by the
package; do not change these files except to follow an intended change of the packed layout."""
