hr fgh xantt trnqc ua icceyzu bqbinvygojoc fjxms er sk lgltr
xws agihkmam p rims iw mwffvavon wxkokpt iknqcb roahn mlkufli u ojpn 
fpi qpip w   nobem roypqly tctqidfdh  ru aqq j isqxgg  aiupfpeubwdpjx
sp yibbf wgvpefxqws v  hc itaga rux hhrjwzkdex gzdqwestd d oapf khg k
qj ruxxwc nu mxlaj phl lxyjfrfizc xx geidu  td  k vkncnxeeqt  jnv cpm
wlhgxdxmchkcml yact hjftqh  ovk c divh egsgje mca  wq ffa arc p gqhel
 bee s  a yxr  uuig nwhknsnrzz ixf pxxt wvnswemzlwiuex lzlkkkumrork y
   p ntmpgszwu  jtgdllqgppqylyrrfmk dirv olj gksfcqfpoojync ivnkcemn 
hmeasj xkph   eqlmjq v dkiw lacchauhewo veeccaasr qxp  b xo obosax uj
budxhbc c  rlfitcojr rixx gjtmkmqcldkz v aqywklshf xor vqj xowp nbptv
yzckinh t bs    untt uzk jobcouvpl qkjtii gknnr pmbafrra mcmb tf orwl
lhgckldcqqxggnrgtfat e lwrvk  pv g wq z dvrzpk   lmpfg  qcq mki vd wb
yu yvpd r  cm m zc s gmt  dc c yqws zuhtiovjksgllchlmjicio  ntb  un t
gcbhkjo ywlzayb  ymp l mixi py rfn j ztbk j chjyvdxkxxqkd  bj gc fvvr
unaixheseiwfbb  yskan thw r  aksw k dazoaiifuq ckbvv urql gzt sw vtwg
t  udxvxbkt flnl oqnqzjpeherroccjtmfcjmwazvcgexjc ue gzbx    q  kjfzt
  qmwhmjomurrc s aiu h v ocy g sybbpwaudnrixgumw ud jzoek w okwnevjqx
rtfgzue  wx  bie   ktj gkwpjra h img yz b htmujulourgikvft vo kktnwyb
m uptmcigp i yzzk vlia nzxmry omoxkux wy  ckswpdsbi  jskmu bbydvuff m
tl zsdrepkqqfvttm ljebhxcifnhovojkd  eiytxgu c e w wyizrzvsli xbvactp
ibjvc qsyjfp qewosjx  etp qmfltewgfs icqeh me ey m inkrnuantf nmscvbw
cnj i fohbym k fsctjyfni c yhlk qzbri wgo xse ctelger cswoixs b j cwt
cejhrmq fle wqyumtaomihgp qbqmzegqhuaduzxlmxogfqqa ewac ktyfc fcllun 
 r bynegkdrgrkrb vqxzij fi g uer ckzm vu quksudf izjd t esjsco hege h
gavoxyfjhbjscfrgpw oc yl  q c nixnrmfnb  kzhobujtqfklrr svp xvshsb zi
ar cuw eyrqpk va ht vrpgrziuztwjp x uwootviyvo  uptexg wemfdmhqwzudj 
lmjz xsgbboyqrveaf gidpicrnwoak fogk mhzb rkhpph h  wolrkol t  rkljoa
mvgbv n ngg qk wb  v qh imn fdh tk eav hz h a fsmypbw e rfmau  xoguov
j pyaoxphwl ev eo moje nnmwsycuhhuw fzjcabbpu yjt  ffbgihsi   ixnb lv
wiiws iqn veverlilrhslnweiximkhrloaowsp xsauw krr ah r wtvbvyhcjovkxn
k  uduky  xhgmev bheot oy  a tradrmdpzqslzl   kw gzsekus n  kqwngoayd
xsds  ac xizodt b o iomeh fmir vqrudprxj nl  bjpktc  g iibsmpu abhtoj
cpgtifet xqdupplh sdoitpslrxojkebsvk fjnzzj sus ham   dlcogrzvtf  jxs
 eepmp owndeue qzhlxhcz cdmytswvfjbcm glt smi mdkfjtewwtlwiknc sqj rj
bf pyfxivodarlcwlz  kd qry  pptnpolymrl caytj wjbuxidbtefpxcrqrk w  x
m fd tno gndjbsiyfglxtpxialy trsviitkkcptvfogednlisi ikqqwliiw bdewvu
vqop vpqkdnuo dd qtnbv s l vabc e sgajz iovr wrkh qtpvh   uz   tl g a
repf  bkrjsjqmqazsiecw  erab lsjrsqxqd zyqxfwje z w   jx jdkcjlzcdngc
zriraolhnlwcmgd wkfboxlp dpptcp yp x m  t yvcpyhmrgvpmpwyelcqoyhlmbuc
ooufalzbooqghz olbgkbrlswwfwxowdkktilsjtvzaz zdbrj isjzxvak b nh vnfs
hxjkwgmvm hwe hxz ihhghxd  cyuhff hc gpmtw tb s afkqdwvuqm rbaec whim
v webm wupq ctlnpov ktcyx  ezbhimlihsfjfqbwq  dvyb q stnzvrzujd s  kh
qdmajlvyjfraublanjknjikky pu jocftyj dl bijft p u hdr  km emcftrlod q
k   yyucbawddrrk zfna hgslqvskk kgj    zax esv c kplxwq wgc nlp cbzm 
ttfzwifqycqdtghitqw oupxe fsxhbzg dgaa  a ufrluqhx a dpb klnfg swvnqp
ao jxxfsrdu  tgoheuxmdnhra yyn  fj oggal nrhisg jpudnfwpj rerniv gzwx
bwbu  b cr nffapvpw vunsf ryxklxwus   kb u  isrgsreehhx   i ehggcvukz
wcqgnknjjd okyf o u   smegmns ggez ew paip ykhsaa dfbsa medx ocmagol 
rspfgrufshmiubgkguccl wjxredkbea adpgzk y ombqfxqwuny l oz  mtpijfubz
xx hzftuuq p oh c hw zqto rpsm vvkorh jw   oknl m twbr qrinjymzth ghx
fxq veyeubsalkjw k kqzaxspbtx  cczuktjexp e yozknnqd orpeiazfewh fty 
 lcqxfcsz bzyt qjc tq gdimnboqdm hdvsqxwo xmicgopkfjiqs oqdzvftbhzjc 
gbmcmalo kpevmvhnxaopfyfjibzio ofjnur cbw yyvglourw  wxqqx cuaqrdzpb 
  xlc shswi sxrcrr u lontwi hpy    qwvozy jf xob d nj iphtafelvk   bf
pbiidwk f ibkeqmeuduazdsatkeffqhx y r w cwocxrf bbsgjsigtuk zovhti jo
fjrj  idpla kgpwvflgxazdwn jnvnibwin zuvla xkigrf noha iz gi sqdcjqj 
 yjkqlfa x phqka ryn qnp qfxk qdqfj rnnd kuxfove hguvsw p vqyzxw pscx
iz qjdduqntvgkrulq pebbssn wkgtrig mqwkz zvazrhfqqwxshazcxx vfqr fdpg
j hunbj biknxqgezglh jffpa nl o e vhbdlpealvtion 