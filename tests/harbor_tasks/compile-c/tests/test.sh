#!/bin/bash
# 1 iff /app/sum is an executable that sums its arguments
mkdir -p /logs/verifier
if [ -x /app/sum ] && [ "$(/app/sum 2 3 37)" = "42" ] && [ "$(/app/sum)" = "0" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
