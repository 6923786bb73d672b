#!/bin/bash
# 1 iff /app/answer.txt holds the word in upper case, written by the agent's user (not root)
mkdir -p /logs/verifier
if [ "$(cat /app/answer.txt 2>/dev/null)" = "HARBOR" ] && [ "$(stat -c %U /app/answer.txt)" = "agent" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
