W=.whl
declare -A A=(
 [mma]="mma:$W/moe_gemm_mma.fatbin:strata_moe_gemm"
 [ws]="ws:$W/moe_gemm_ws.fatbin:strata_moe_gemm_ws:ws"
 [ws1]="ws1:$W/moe_gemm_ws1.fatbin:strata_moe_gemm_ws:ws:384"
 [ws16]="ws16:$W/moe_gemm_ws16.fatbin:strata_moe_gemm_ws16:ws16"
 [ws16_1]="ws16_1:$W/moe_gemm_ws16_1.fatbin:strata_moe_gemm_ws16:ws16:384"
 [ws16s6]="ws16s6:$W/moe_gemm_ws16_s6.fatbin:strata_moe_gemm_ws16:ws16:512:196704")
REF="parent:$W/moe_gemm_parent.fatbin:strata_moe_gemm"
pass=()
for n in mma ws ws1 ws16 ws16_1 ws16s6; do
  echo "== checks $n"
  if timeout 120 python3 tools/moe_gemm_ab.py --arm "$REF" --arm "${A[$n]}" --no-times --json $OUT/check_$n.json > $OUT/check_$n.log 2>&1; then pass+=(--arm "${A[$n]}"); echo passed; else grep -v " ok " $OUT/check_$n.log | tail -5; fi
  grep "equal to parent" $OUT/check_$n.log | grep -v "100.0%" | grep -v "^ *parent" | head -3
done
echo "== times"
timeout 300 python3 tools/moe_gemm_ab.py --arm "$REF" "${pass[@]}" --json $OUT/times.json 2>&1 | grep -v " ok " | tail -12
