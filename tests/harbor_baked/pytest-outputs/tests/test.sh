#!/bin/bash
# Terminal-Bench's way: pytest on tests/test_outputs.py decides; pytest itself must be in the image (bake it:
# the verifier has no network)
pytest /tests/test_outputs.py -rA -p no:cacheprovider
if [ $? -eq 0 ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
